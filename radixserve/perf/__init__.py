"""Performance models: the roofline floor of a workload (``roofline``, no torch) and the
measurement of a machine's rates it needs (``probe``, torch)."""
