"""The API server's tokenizer: ``transformers`` in the tokenizer-only mode it runs in
where torch is not installed.

The API server tokenizes, renders chat templates and detokenizes; none of it touches
torch, yet ``import transformers`` imports torch whenever it is installed: ~1.5 s of CPU
at every start (beside the worker loading the model on the same cores) and ~240 MB of
resident memory per API-server process. Marking torch absent before transformers is first
imported gives the same tokenizer classes, tokens and chat templates
(``tests/unit/test_tokenizer_loader.py`` compares them, in fresh processes).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

# transformers' one line at import saying that models are unavailable without torch.
_ADVISORY_OFF = "TRANSFORMERS_NO_ADVISORY_WARNINGS"


def load_tokenizer(model_dir: Path) -> Any:
    """``AutoTokenizer.from_pretrained(model_dir)``, keeping torch out of this process
    unless something here has imported it already (a GGUF converted in this process:
    then transformers has been imported with it, and nothing is saved)."""
    if "torch" not in sys.modules and "transformers" not in sys.modules:
        # A None entry is what Python's import system reads as "not installed":
        # importlib.util.find_spec (transformers' check) answers None, `import` raises.
        sys.modules["torch"] = None  # type: ignore[assignment]
        advisory = os.environ.get(_ADVISORY_OFF)
        os.environ[_ADVISORY_OFF] = "1"
        try:
            import transformers  # noqa: F401
        finally:
            if advisory is None:
                del os.environ[_ADVISORY_OFF]
            else:
                os.environ[_ADVISORY_OFF] = advisory
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
