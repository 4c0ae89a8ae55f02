package tune

import (
	"fmt"
	"runtime"
)

// settling is the last step every auto resolver of this package shares
// (ResolveDispatcher, ResolveCPAttention, ResolveTPOverlap), once its rules
// have not settled the case: the table's choice for key, or, when the
// table has none or cannot be read, a measurement, which is then stored.
// A table that cannot be read or written costs a measurement, not the
// run. E is the table's entry type, T the measurement's.
type settling[E, T any] struct {
	setting string       // the field as the log names it: "parallel.tp_overlap auto"
	what    string       // what a measurement compares: "both paths"
	key     fmt.Stringer // the case
	// path is the table's file; noTable, when not nil, says why there is
	// none (the Default*Cache's error).
	path    string
	noTable error
	lookup  func() (E, bool, error)
	store   func(T) error
	// measure measures the case (its error says what failed and how to
	// skip it); entry and timing give a table entry's or a measurement's
	// choice and its figures for the log.
	measure func() (T, error)
	entry   func(E) (choice, figures string)
	timing  func(T) (choice, figures string)
}

// settle returns the choice, saying in log (say) where it came from.
func (s settling[E, T]) settle(say func(format string, args ...any)) (string, error) {
	if s.noTable == nil {
		e, ok, err := s.lookup()
		switch {
		case err != nil:
			say("%s: %v; measuring instead", s.setting, err)
		case ok:
			choice, figures := s.entry(e)
			say("%s: %s, from the table %s (%s; %s)", s.setting, choice, s.path, figures, s.key)
			return choice, nil
		}
	}
	say("%s: measuring %s (%s)", s.setting, s.what, s.key)
	t, err := s.measure()
	// The measurement's tensors are garbage now; collecting them hands
	// their device memory back before the model allocates.
	runtime.GC()
	if err != nil {
		return "", err
	}
	stored := "not stored: "
	switch {
	case s.noTable != nil:
		stored += s.noTable.Error()
	default:
		if err := s.store(t); err != nil {
			stored += err.Error()
		} else {
			stored = "stored in " + s.path
		}
	}
	choice, figures := s.timing(t)
	say("%s: %s, measured: %s (%s)", s.setting, choice, figures, stored)
	return choice, nil
}

// sayTo is a resolver's say: one formatted sentence to log, when not nil.
func sayTo(log func(string)) func(format string, args ...any) {
	return func(format string, args ...any) {
		if log != nil {
			log(fmt.Sprintf(format, args...))
		}
	}
}
