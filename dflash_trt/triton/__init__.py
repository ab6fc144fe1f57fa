"""Triton Inference Server: model repository (repo), config checks (config), BLS engine adapters
(bls), python-backend models (models/), a local server from nvidia-pytriton (server), client (client)."""
