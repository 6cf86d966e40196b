"""Install flash-attn's pure-PyTorch padding helpers (no CUDA) into the running venv: make install-openrlhf.

OpenRLHF 0.11.2's ``openrlhf.models`` imports ``flash_attn.bert_padding`` (``unpad_input``, ``pad_input``,
``index_first_axis``, ``rearrange``) and ``flash_attn.utils.distributed.all_gather`` at module load, for
its packed-samples and ring-attention layout. flash-attn's package ``__init__`` imports its CUDA
extension, which cannot be built without CUDA, so on a CPU machine ``pip install flash-attn`` fails and
``import flash_attn`` would too. This takes those two modules, unchanged, from flash-attn's own source
release (``sdist``: a .tar.gz passed as the argument, from ``pip download``) and installs them as the
package ``flash_attn`` with an ``__init__`` that holds only its version. Nothing else of flash-attn is
installed: in particular not ``flash_attn.ops.triton.cross_entropy``, whose import OpenRLHF tries in
``log_probs_from_logits`` and, failing it, takes its own PyTorch path (the path a CPU runs).

    python tools/flash_attn_padding.py flash_attn-2.8.3.tar.gz
"""

from __future__ import annotations

import pathlib
import sys
import sysconfig
import tarfile

MODULES = ("flash_attn/bert_padding.py", "flash_attn/utils/distributed.py")


def main(sdist: str) -> None:
    target = pathlib.Path(sysconfig.get_paths()["purelib"])
    with tarfile.open(sdist) as archive:
        members = {m.name.split("/", 1)[1]: m for m in archive.getmembers() if "/" in m.name}
        version = archive.extractfile(members["flash_attn/__init__.py"]).read().decode().splitlines()[0]
        assert version.startswith("__version__"), version
        for name in MODULES:
            path = target / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(archive.extractfile(members[name]).read())
    (target / "flash_attn/__init__.py").write_text(
        f"{version}\n# Only bert_padding and utils.distributed (tools/flash_attn_padding.py): no CUDA extension here.\n")
    (target / "flash_attn/utils/__init__.py").write_text("")
    print(f"flash_attn ({version}): {', '.join(MODULES)} -> {target}")


if __name__ == "__main__":
    main(sys.argv[1])
