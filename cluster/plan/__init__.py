"""`tandem plan`: which P:D split of W workers (or W colocated replicas) serves a workload best within SLOs.

It profiles one prefill worker's and one decode worker's engine for real (profile.py), fits a step-time
model (step_model.py), measures or takes the KV transfer's cost (transfer_model.py), simulates each
deployment (deployment.py) on the workload's requests with the engines' scheduling rules (engine_sim.py,
simulator.py), scores each run as `tandem bench serve` scores a measured one (predict.py) and prints the
table and the recommendation (report.py, command.py). Runs in the user's process; uses cluster/bench/ for
the workloads and the metrics, and nothing else of cluster/.
"""
