# A package whose mistakes only show across files: flagged lines end with `# expect: CODE`.
from .losses import gather_features

__all__ = ["gather_features"]
