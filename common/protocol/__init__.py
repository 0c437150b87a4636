"""The contract both ends speak: the protobuf messages, their plain-dataclass twins, the codec between them, error codes and channel settings. No tensors."""
