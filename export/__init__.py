"""Turn checkpoints and outside models into served artifacts: TorchScript and ONNX, with parity proved."""
