"""The exact maths both ends share, as pure functions on tensors: the sampling transform, the acceptance rules, sparse q, BiLD predicates, feature encoding."""
