"""The CUDA IPC transport ('ipc'): prefill and decode workers on one GPU (one host) exchange KV without moving
it through any wire.

The decode side maps the prefill side's whole pool tensor once per pair channel from a handle the sender
publishes (`pool_handle.py`: torch.multiprocessing's reduction, unpickled through an allow-list); each
transfer is then a manifest and a few control words over the pair's gloo channel (the dist transport's
`PairChannel`, epochs and threads) and one device-to-device copy per run into the receiver's own blocks,
verified by the manifest's checksums (`protocol.py`, `landing.py`). `transport.py` holds `IpcSender` /
`IpcReceiver`. CPU pools in shared memory take the same path (tests).
"""
