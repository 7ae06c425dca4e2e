"""The DSpark block draft: model, heads and training objective."""
