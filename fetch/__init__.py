"""Getting the embedded default models onto this machine: download, dequantise, install."""
