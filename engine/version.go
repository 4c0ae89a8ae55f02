package engine

// Version is the mktrain release; checkpoints record it.
const Version = "0.1.0"
