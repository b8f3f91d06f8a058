"""Workers sharing one GPU. A package of its own for where it runs, not for what it shares: its Ray test starts a
Ray with a logical GPU after stopping any other (a driver has one Ray), and collected before multinode/ and the
cluster tests that start the session's local Ray (tests/support/cluster_rig.py) it runs before that Ray starts, so
that Ray is not stopped half way through the session and started again (~8 s on the 2-core CI machine)."""
