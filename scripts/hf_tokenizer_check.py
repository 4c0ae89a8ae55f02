#!/usr/bin/env python3
"""Checks that a mktrain Hugging Face export carries a tokenizer that
transformers loads, and that transformers' greedy continuation of a prompt
equals `mktrain sample --temperature 0` on the checkpoint it came from.

    mktrain export --format hf --dtype fp32 RUN EXPORT
    mktrain sample --checkpoint RUN --prompt TEXT --tokens N --temperature 0 >SAMPLE
    python scripts/hf_tokenizer_check.py EXPORT --prompt TEXT --mktrain-sample SAMPLE \
        [--prompt TEXT2 --mktrain-sample SAMPLE2]... --tokens N [--texts tokenizer/testdata/texts.json]

It loads EXPORT with AutoTokenizer and MixtralForCausalLM (fp32, CPU),
and for each prompt generates N tokens greedily (generate stops at the
config's EOS, as mktrain sample does), decodes without special tokens, and
compares the text with its SAMPLE (mktrain's output line). With --texts (a JSON list of strings, or an
object holding one under "texts"), it also prints how many of them
AutoTokenizer encodes to ids that decode back to the text. Prints one JSON
object; exits 1 when the continuations differ.
"""
import argparse
import json
import sys

import torch
from transformers import AutoTokenizer, MixtralForCausalLM


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("export")
    p.add_argument("--prompt", action="append", required=True)
    p.add_argument("--tokens", type=int, default=20)
    p.add_argument("--mktrain-sample", action="append", required=True, help="file holding mktrain sample's output, one per --prompt")
    p.add_argument("--texts", help="JSON list of strings for a round-trip count")
    a = p.parse_args()

    if len(a.prompt) != len(a.mktrain_sample):
        p.error("give one --mktrain-sample per --prompt")
    tok = AutoTokenizer.from_pretrained(a.export)
    model = MixtralForCausalLM.from_pretrained(a.export, torch_dtype=torch.float32).eval()
    cases = []
    for prompt, sample in zip(a.prompt, a.mktrain_sample):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.tokens, do_sample=False,
                                 pad_token_id=tok.eos_token_id if tok.eos_token_id is not None else 0)
        hf_text = tok.decode(out[0], skip_special_tokens=True)
        with open(sample, encoding="utf-8") as f:
            mk_text = f.read()
        if mk_text.endswith("\n"):
            mk_text = mk_text[:-1]
        generated = out[0][ids.shape[1]:].tolist()
        cases.append({"prompt": prompt, "prompt_ids": ids[0].tolist(), "generated_ids": generated,
                      "distinct_generated_ids": len(set(generated)), "transformers": hf_text, "mktrain": mk_text,
                      "equal": hf_text == mk_text})
    result = {"tokenizer_class": type(tok).__name__, "vocab": len(tok), "cases": cases,
              "equal": all(c["equal"] for c in cases)}
    if a.texts:
        with open(a.texts, encoding="utf-8") as f:
            texts = json.load(f)
        if isinstance(texts, dict):
            texts = texts.get("texts", [])
        texts = [t for t in texts if isinstance(t, str)]
        ok = sum(tok.decode(tok(t, add_special_tokens=False).input_ids) == t for t in texts)
        result["round_trips"] = f"{ok}/{len(texts)}"
    print(json.dumps(result, ensure_ascii=False))
    return 0 if result["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
