"""The capture stage: target hidden states -> store."""

from eyas.capture.capture import CaptureConfig, run_capture

__all__ = ["CaptureConfig", "run_capture"]
