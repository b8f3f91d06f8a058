"""The gRPC transport: KV blocks as one client stream per transfer (`tandem.v1.KVTransfer/Push`).

Runs on an asyncio loop thread inside the prefill worker (sender) and the decode worker (receiver's
server). `codec.py` frames the manifest, the data chunks and their trailing checksums without protobuf
copies of the KV bytes; `admission.py` bounds concurrent transfers on the receiver with a FIFO queue;
`sender.py` / `receiver.py` hold `GrpcSender` / `GrpcReceiver`, the `KVSender` / `KVReceiver` of this
transport.
"""
