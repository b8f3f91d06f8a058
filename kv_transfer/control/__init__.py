"""The rank transports' control plane: one authenticated connection per (sender, receiver, lane), its
listener on the receiver, the frames of one transfer (docs/kv_transfer.md, "The control plane")."""
