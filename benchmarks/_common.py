"""What every benchmark's result file starts with: title, exact command, versions.

Scripts import it as `_common` (their own folder is first on sys.path when run
as `python benchmarks/<script>.py`, also under torchrun).
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path


def result_header(script: str, argv: list[str] | None, *, device_detail: str = "",
                  after_cores: str = "") -> str:
    """The first lines of a result file: '# <script> (<time>)', the command that
    produced it (argv None = this process's arguments), and the versions and
    machine ('device cpu<device_detail>, 2 cores<after_cores>.')."""
    from hybrid_engine.cli import env_info

    info = env_info()
    name = Path(script).name
    cmd = " ".join(["python", f"benchmarks/{name}", *(sys.argv[1:] if argv is None else argv)])
    if info["device"] == "cpu":  # CPUs of one "class" differ: AMX makes bf16 GEMMs ~6x faster
        cpu = cpu_name()
        device_detail += f" ({'' if cpu in device_detail else cpu + ', '}{cpu_isa()})"
    return (f"# {Path(script).stem} ({datetime.datetime.now().isoformat(timespec='seconds')})\n\n"
            f"Command: `{cmd}`\n\n"
            f"Versions: torch {info['torch']}, vLLM {info['vllm']} ({info['vllm_build']}), "
            f"transformers {info['transformers']}; device {info['device']}{device_detail}, "
            f"{info['cpu_count']} cores{after_cores}.\n\n")


def cpu_isa() -> str:
    """The CPU's bf16 matrix instructions as /proc/cpuinfo lists them: AVX512-BF16
    and AMX-BF16, each present or not (bf16 GEMM peaks differ several-fold)."""
    flags = _cpuinfo("flags")
    if flags is None:
        return "ISA unknown"
    return ", ".join(f"{label} {'yes' if flag in flags.split() else 'no'}" for flag, label in
                     (("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX-BF16")))


def _cpuinfo(key: str) -> str | None:
    """The first /proc/cpuinfo value of key (None: no such file or key)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() == key:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def result_path(out_dir: str | Path, topic: str, *, tag: str = "", quick: bool = False) -> Path:
    """out_dir/<topic>_<device><tag>_<yyyymm>[_quick].md (out_dir created):
    device is "cpu" or the CUDA device's name."""
    import torch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = "cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name(0).replace(" ", "-")
    stamp = datetime.date.today().strftime("%Y%m")
    return out / f"{topic}_{device}{tag}_{stamp}{'_quick' if quick else ''}.md"


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (else what platform knows)."""
    name = _cpuinfo("model name")
    if name:
        return name
    import platform

    return platform.processor() or "unknown CPU"


def preset_model(cache_dir: str | Path, preset: str) -> Path:
    """The tiny-model preset's HF folder under cache_dir, written on first use
    (random weights: `hybrid_engine.models.tiny`); exits naming the presets if
    there is no such preset."""
    from hybrid_engine.models.tiny import PRESETS, write_tiny_model

    if preset not in PRESETS:
        raise SystemExit(f"--preset {preset!r}: not a preset ({', '.join(PRESETS)})")
    model = Path(cache_dir) / preset
    if not (model / "config.json").is_file():
        write_tiny_model(model, PRESETS[preset])
    return model
