"""The command-line clients of a running `tandem serve`, each a `tandem` subcommand run in the user's process:
`tandem client` (`generate.py`: stream one completion over gRPC `tandem.v1.Tandem/Generate`, then its timing)
and `tandem scale` (`scale.py`: add, drain or list workers through the HTTP admin route `/admin/workers`).
They import nothing of the server: only the wire (proto/, JSON over HTTP).
"""
