"""Model description, layers and loading: what one pipeline stage needs to run its layers."""

from stagewise.model.config import ModelConfig, RopeConfig

__all__ = ["ModelConfig", "RopeConfig"]
