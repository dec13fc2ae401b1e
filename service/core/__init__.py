"""The ground every room stands on: the spec, errors, config, repository, settings, preprocessing and decoding,
sample images and the metrics records.

Imports no other room of ``service`` and not torch at import time, so the ONNX serving path stays torch-free.
"""
