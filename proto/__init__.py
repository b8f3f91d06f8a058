"""Tandem wire schema: tandem.proto and its generated stubs (regenerate with proto/generate.sh)."""
