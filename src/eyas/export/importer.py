"""Import of published EAGLE-3 checkpoints lives in the model foundation (eyas.model.importer), because
bench and train load drafters too; this module keeps the export stage's name for it."""

from eyas.model.importer import *  # noqa: F401,F403
from eyas.model.importer import load_any_drafter, load_eagle3_checkpoint  # noqa: F401
