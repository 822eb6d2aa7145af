"""Build of the compiled CPU-Adam (hf_zoffload.ops._cpu_adam); metadata lives in setup.cfg.

Environment switches, read at build time only (nothing is compiled at run time):
  HF_ZOFFLOAD_PORTABLE_BUILD=1  no -march=native: baseline x86-64 code plus AVX2/FMA/F16C and
                                AVX-512-BF16 clones chosen at run time (gcc, x86-64); elsewhere
                                baseline only.  Use it for wheels that travel to other machines.
  HF_ZOFFLOAD_NO_OPENMP=1       build without OpenMP (sequential kernel), as if the compiler
                                lacked -fopenmp.
"""

import os
import sys
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# -O3 and -fno-math-errno: without the latter sqrtf keeps its errno path and stays scalar
# (measured 4.6x slower).  -ffp-contract=off: the kernel places its FMAs itself (fmaf, where
# torch fuses); compiler contraction elsewhere would make rounding depend on alignment and break
# the bitwise equality across thread counts and chunk splits.
BASE_FLAGS = ["-O3", "-fno-math-errno", "-ffp-contract=off"]
TRUTHY = {"1", "true", "yes", "on"}

OPENMP_PROBE = """
#include <omp.h>
int main(void) {
    int n = 0;
#pragma omp parallel reduction(+:n)
    n += omp_get_num_threads() > 0;
    return n > 0 ? 0 : 1;
}
"""
PLAIN_PROBE = "int main(void) { return 0; }\n"


def _env_on(name):
    return os.environ.get(name, "").strip().lower() in TRUTHY


def _warn(msg):
    # pip shows build output with -v; print to stderr so it also lands in logs and CI output.
    print(f"WARNING (hf_zoffload build): {msg}", file=sys.stderr, flush=True)


class BuildExt(build_ext):
    """Adds flags the compiler accepts, found by compiling small probe programs."""

    def _compiles(self, source, flags, *, link=False):
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "probe.c")
            with open(src, "w") as fh:
                fh.write(source)
            devnull = os.open(os.devnull, os.O_WRONLY)
            saved = os.dup(2)
            os.dup2(devnull, 2)  # the compiler's complaint about a probe is not the user's error
            try:
                objs = self.compiler.compile([src], output_dir=tmp, extra_postargs=flags)
                if link:
                    exe = os.path.join(tmp, "probe")
                    self.compiler.link_executable(objs, exe, extra_postargs=flags)
            except Exception:
                return False
            finally:
                os.dup2(saved, 2)
                os.close(saved)
                os.close(devnull)
        return True

    def build_extensions(self):
        cflags, ldflags, macros = list(BASE_FLAGS), [], []
        if _env_on("HF_ZOFFLOAD_PORTABLE_BUILD"):
            macros.append(("HZ_PORTABLE", "1"))
            print("hf_zoffload build: portable (no -march=native; run-time ISA dispatch)")
        elif self._compiles(PLAIN_PROBE, ["-march=native"]):
            cflags.append("-march=native")
        else:
            macros.append(("HZ_PORTABLE", "1"))
            _warn("the compiler rejects -march=native; building the portable kernel instead.")
        if _env_on("HF_ZOFFLOAD_NO_OPENMP"):
            _warn("HF_ZOFFLOAD_NO_OPENMP is set: the CPU-Adam kernel will run on one thread.")
        elif self._compiles(OPENMP_PROBE, ["-fopenmp"], link=True):
            cflags.append("-fopenmp")
            ldflags.append("-fopenmp")
        else:
            _warn(
                "the compiler does not accept -fopenmp: the CPU-Adam kernel is built without "
                "OpenMP and will run on one thread (several times slower on many cores). "
                "Install a compiler with OpenMP support (gcc with libgomp) and rebuild."
            )
        for ext in self.extensions:
            ext.extra_compile_args = cflags + list(ext.extra_compile_args or [])
            ext.extra_link_args = ldflags + list(ext.extra_link_args or [])
            ext.define_macros = macros + list(ext.define_macros or [])
        print(f"hf_zoffload build: CFLAGS {' '.join(cflags)}; macros {macros or 'none'}")
        super().build_extensions()


def _extensions():
    from Cython.Build import cythonize

    ext = Extension(
        "hf_zoffload.ops._cpu_adam",
        sources=["cython_ext/cpu_adam.pyx"],
        include_dirs=["cython_ext"],
        # listed so that an sdist carries them (cythonize swaps the .pyx for the generated .c)
        depends=[
            "cython_ext/cpu_adam.pyx",
            "cython_ext/cpu_adam.pxd",
            "cython_ext/adam_kernel.h",
            "cython_ext/adam_kernel_body.h",
            "cython_ext/adam_fused.h",
            "cython_ext/adam_m16_fused.h",
            "cython_ext/adam_q8_portable.h",
            "cython_ext/adam_q8_fused.h",
            "cython_ext/adam_q4_portable.h",
            "cython_ext/adam_q4_fused.h",
            "cython_ext/adam_coded_fused.h",
            "cython_ext/adam_coded512.h",
            "cython_ext/adam_undo.h",
        ],
    )
    return cythonize(
        [ext], compiler_directives={"language_level": 3}, include_path=["cython_ext"], quiet=True
    )


setup(ext_modules=_extensions(), cmdclass={"build_ext": BuildExt})
