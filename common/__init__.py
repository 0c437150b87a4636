"""What the edge and the cloud must agree on: the verification maths, the wire contract, model loading."""
