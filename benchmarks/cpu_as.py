"""Run a flux2klein command as on a CPU that lacks some of this one's features, to measure what such a
CPU's programs are: the flags named are taken out of what /proc/cpuinfo says before anything reads
them, so the backend dispatch (core/models/kernels.py, core/models/trace.py) picks that CPU's kernel
plugin and bf16 form, and XLA is told not to compile past that CPU's instruction set
(--xla_cpu_max_isa). The instructions still run on this CPU, at its clock and cache sizes: it measures
the forms, not the other CPU.

    # an AVX-512 CPU without bf16 (Intel Skylake-SP to Ice Lake), on a Zen 4 or an AMX Xeon:
    python benchmarks/cpu_as.py --without avx512_bf16 -- bench --model DIR --dtype fp32 --no-store --json
    # an AVX2 CPU without AVX-512 (AMD Zen 2 and 3, Intel client CPUs): every AVX-512 flag goes with avx512f:
    python benchmarks/cpu_as.py --without avx512f -- bench --model DIR --dtype fp32 --no-store --json
    # the same CPU with no kernel plugin (XLA's forms: what it ran before the float32 plugin):
    python benchmarks/cpu_as.py --without avx512_bf16 --no-plugin -- bench --model DIR --dtype fp32 --no-store --json
"""

from __future__ import annotations

import argparse
import os
import sys

# XLA's name for the widest instruction set left once a flag is gone, widest first.
MAX_ISA = (("avx512f", "AVX2"), ("avx512_bf16", "AVX512"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--without", required=True, help="comma-separated /proc/cpuinfo flags to take out")
    parser.add_argument("--no-plugin", action="store_true", help="no kernel plugin: XLA's forms")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the flux2klein command and its options")
    args = parser.parse_args()
    without = frozenset(flag for flag in args.without.split(",") if flag)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("name the flux2klein command after --")
    isa = next((name for flag, name in MAX_ISA if flag in without), None)
    if isa is not None:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_max_isa={isa}".strip()

    from flux2klein_cli.core.devices import cpu

    flags = cpu.cpu_flags() - without
    if "avx512f" in without:  # no AVX-512 extension (bf16 among them) or AMX without its foundation
        flags = frozenset(flag for flag in flags if not flag.startswith(("avx512", "amx")))
    cpu._host_flags = lambda: flags  # what every later reader of the host's flags gets
    if args.no_plugin:
        from flux2klein_cli.core.models import kernels

        kernels.detect = lambda flags, build=True: kernels.Status(None, "benchmarks/cpu_as.py --no-plugin")
    print(f"as a CPU without {', '.join(sorted(without))}" + (f" (XLA up to {isa})" if isa else "")
          + (", no kernel plugin" if args.no_plugin else ""), file=sys.stderr)
    sys.argv = ["flux2klein", *command]
    from flux2klein_cli.cli.main import console  # the console script's exit, as a user's process ends

    console()


if __name__ == "__main__":
    main()
