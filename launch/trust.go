package launch

// The run's shared secret. Every connection between the nodes of a run
// (the rendezvous and the data connections) opens with a mutual HMAC
// challenge-response over it (internal/peernet.Authenticate), so a
// process that can reach a port but does not know the secret is dropped
// before anything it sends is read. docs/launch.md gives the trust model.
//
// The secret comes from, in order: --secret-file, MKTRAIN_SECRET,
// MKTRAIN_SECRET_FILE. When none is given, node 0 generates one and the
// command prints how to pass it to the other nodes (SecretHint); the
// other nodes then refuse to start without it.

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/mktrain/mktrain/internal/peernet"
)

// ErrSecretRefused is wrapped by the error of a node whose secret another
// node refused: the nodes were given different secrets, a configuration
// error (mktrain run exits 2), not a failure of the run.
var ErrSecretRefused = peernet.ErrSecretRefused

// refusedSecret is an error saying msg that wraps ErrSecretRefused.
type refusedSecret string

func (e refusedSecret) Error() string { return string(e) }
func (e refusedSecret) Unwrap() error { return ErrSecretRefused }

// Secret sources and limits.
const (
	SecretEnv     = "MKTRAIN_SECRET"
	SecretFileEnv = "MKTRAIN_SECRET_FILE"
	// SecretGenerated is Launch.SecretFrom for a secret node 0 made up.
	SecretGenerated = "generated"
	// minSecret is the shortest secret accepted: 16 characters, say
	// 'openssl rand -hex 16' (32).
	minSecret = 16
	// maxSecretFile bounds what is read of a secret file.
	maxSecretFile = 4096
)

// WithSecret is l with the run's secret (Secret, SecretFrom) read from
// file (--secret-file; "" when not given) or the environment (getenv is
// os.Getenv outside tests), or generated on node 0. A single node needs
// none. Problems name the flag or variable, never the secret.
func (l Launch) WithSecret(getenv func(string) string, file string) (Launch, error) {
	if !l.MultiNode() {
		return l, nil
	}
	e := envReader{getenv: getenv}
	l.Secret, l.SecretFrom = e.secret(file, l.NodeRank)
	return l, errors.Join(e.errs...)
}

// secret reads the run's secret for node rank (see the top of this file);
// problems are reported, never the secret itself.
func (e *envReader) secret(file string, rank int) ([]byte, string) {
	var s, from string
	switch {
	case file != "":
		s, from = e.secretFile(file, "--secret-file="+file)
	case e.getenv(SecretEnv) != "":
		s, from = strings.TrimSpace(e.getenv(SecretEnv)), SecretEnv
	case strings.TrimSpace(e.getenv(SecretFileEnv)) != "":
		path := strings.TrimSpace(e.getenv(SecretFileEnv))
		s, from = e.secretFile(path, SecretFileEnv+"="+path)
	case rank == 0:
		return generateSecret(), SecretGenerated
	default:
		e.errorf("node %d has no secret for the run: give every node the same one with %s, %s or --secret-file (node 0 prints one it generated when it has none)", rank, SecretEnv, SecretFileEnv)
		return nil, ""
	}
	if from == "" {
		return nil, "" // reported
	}
	if len(s) < minSecret {
		e.errorf("%s holds a secret of %d characters; use at least %d (e.g. the output of 'openssl rand -hex 16')", from, len(s), minSecret)
		return nil, ""
	}
	return []byte(s), from
}

// secretFile reads a secret from path (its first line, trimmed).
func (e *envReader) secretFile(path, from string) (string, string) {
	f, err := os.Open(path)
	if err != nil {
		e.errorf("%s: %v", from, err)
		return "", ""
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxSecretFile+1))
	if err != nil {
		e.errorf("%s: %v", from, err)
		return "", ""
	}
	if len(b) > maxSecretFile {
		e.errorf("%s is over %d bytes; a secret file holds one line", from, maxSecretFile)
		return "", ""
	}
	line, _, _ := strings.Cut(string(b), "\n")
	return strings.TrimSpace(line), from
}

func generateSecret() []byte {
	var b [16]byte
	rand.Read(b[:])
	return []byte(hex.EncodeToString(b[:]))
}

// SecretHint is what node 0 prints when it generated the run's secret:
// how to start the other nodes with it. "" when the secret was given.
func (l Launch) SecretHint() string {
	if l.SecretFrom != SecretGenerated {
		return ""
	}
	return fmt.Sprintf("no secret was given for the multi-node run, so node 0 generated one: start the other nodes with %s=%s (or put it in a file for --secret-file); set it on every node next time", SecretEnv, l.Secret)
}
