"""kv_transfer/: the wire protocol, every transport between real processes, faults, engine pools."""
