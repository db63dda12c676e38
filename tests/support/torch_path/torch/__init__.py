"""The torch stand-in (`tests/support/torch_standin.py`) as an importable package: the slime tier puts its
parent folder on the PYTHONPATH of the server it starts, where slime's generator example imports torch
through slime's reward functions. Nothing else imports it."""

import sys

from tests.support.torch_standin import fill_torch

fill_torch(sys.modules[__name__])
