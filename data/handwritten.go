package data

// handwrittenText is mixed into the default corpus, one paragraph (one line)
// at a time. It is plain ASCII prose about training language models, written
// for this project.
const handwrittenText = `
A language model learns by guessing the next piece of text. It reads a window of tokens, predicts each following token, and measures how surprised it was. The average surprise is the loss, and training is the slow work of making that number smaller, one small step of gradient descent at a time.
At the very start the model knows nothing, so every byte looks equally likely and the loss sits near the logarithm of the vocabulary size. For a byte-level model that is about five and a half. The first thing it learns is which bytes are common: spaces, the letter e, the full stop. The loss drops quickly as soon as it does.
Next the model learns spelling. After a few hundred steps it knows that a q is followed by a u, that words end before a space, and that a sentence starts with a capital letter. Later it learns which words follow which, and, if the data is regular enough, simple facts such as the order of the days of the week.
A mixture of experts model keeps several feed-forward networks in every layer and sends each token to only a few of them. A small router decides where each token goes. Because only some experts run for each token, the model can hold many more parameters than it spends compute on, and the experts are free to specialise.
The router needs care. If it sends every token to the same expert, the others never learn and the model wastes its capacity. A load-balancing loss gently pushes the router to spread tokens evenly, and a small z-loss keeps its scores from growing without bound. Watching the expert loads during training tells you whether the balance holds.
The validation loss is measured on text the model never trains on. While it falls together with the training loss, the model is learning something general. When the training loss keeps falling but the validation loss turns upward, the model has started to memorise, and more data or a smaller model is the cure.
The learning rate matters more than almost any other setting. Too small and nothing happens; too large and the loss jumps up and never comes back. A short warmup from zero protects the first steps, and a slow decay at the end lets the weights settle into a good valley.
Checkpoints make long runs safe. A good checkpoint holds the weights, the optimizer state, the position of the data loader and the state of every random number generator, so that a run stopped on Tuesday continues on Wednesday exactly as if it had never stopped.
Good training code is boring to read. It loads a batch, runs the model forward, computes the loss, runs the model backward, clips the gradients, and takes an optimizer step. Everything else, the logging, the evaluation and the saving, is there to tell you whether those few lines are doing their job.
`
