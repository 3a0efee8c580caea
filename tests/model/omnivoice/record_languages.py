"""Write ``mstar/model/omnivoice/languages.tsv``: the language names and ids OmniVoice was
trained with, read from the reference package (``omnivoice.utils.lang_map``, generated there
from k2-fsa/OmniVoice's ``docs/lang_id_name_map.tsv``; Apache-2.0).

    python tests/model/omnivoice/record_languages.py   # with omnivoice importable
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    from omnivoice_reference import VERSION, reference

    reference()  # puts the private install on sys.path
    from omnivoice.utils.lang_map import LANG_NAME_TO_ID

    target = Path(__file__).resolve().parents[3] / "mstar" / "model" / "omnivoice" / "languages.tsv"
    lines = [f"# OmniVoice's language names and ids (omnivoice {VERSION}, Apache-2.0); "
             "tests/model/omnivoice/record_languages.py writes this file"]
    lines += [f"{name}\t{code}" for name, code in sorted(LANG_NAME_TO_ID.items())]
    target.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines) - 1} languages to {target}")


if __name__ == "__main__":
    main()
