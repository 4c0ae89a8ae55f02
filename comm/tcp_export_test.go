package comm

// Cut drops every link of w without a goodbye and without telling anyone,
// as the death of its process would.
func (w *TCPWorld) Cut() {
	w.closeOnce.Do(func() {
		close(w.closing) // the node's own readers must not report the loss
		for _, p := range w.peers {
			if p != nil {
				p.link.Close()
			}
		}
	})
}
