"""The model side: architectures, checkpoint loading, segmentation, ONNX export, execution."""
