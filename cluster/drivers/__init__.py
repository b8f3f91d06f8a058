"""Programs that drive a Tandem cluster from outside: `tandem demo` and the `ray job submit` job.

They run in a driver process (the `tandem demo` process, or the driver of a Ray job started by
deploy/job.py): start the serving stack in process (a cluster of worker actors and/or one local engine
behind the gRPC front end on 127.0.0.1:0), send a mixed workload through real `tandem.v1.Tandem`
stubs, print what the client measured side by side, and check that every KV pool ended empty. The
scripts in deploy/ are thin wrappers around these modules.
"""
