"""Offline measurements: decode speed against transformers, machine bandwidth, provenance."""
