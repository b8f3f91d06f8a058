"""The gRPC transport: KV blocks on `tandem.v1.KVTransfer/Push` streams that a sender keeps open and uses for
one transfer after another (a session: the manifest and the chunks out, one KVAck back per transfer).

Runs on an asyncio loop thread inside the prefill worker (sender) and the decode worker (receiver's
server). `codec.py` frames the manifest, the data chunks and their trailing checksums without protobuf
copies of the KV bytes; `streams.py` keeps the sender's streams, `push.py` writes one transfer's messages,
`inbound.py` reads them on the receiver; `admission.py` bounds concurrent transfers on the receiver with a
FIFO queue; `sender.py` / `receiver.py` hold `GrpcSender` / `GrpcReceiver`, the `KVSender` / `KVReceiver` of
this transport (the receiver also serves the older one-transfer Push).
"""
