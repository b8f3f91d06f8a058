"""cluster/bench/: `tandem bench serve` and `tandem bench compare` end to end, and their metrics."""
