"""cluster/: front ends, the coordinator and its workers on a local Ray, the CLI, the drivers."""
