"""Build kvstream_hicache and its Cython io_uring extension against the system liburing.

liburing is linked statically where the system has ``liburing.a`` (Debian's and Fedora's -dev packages
do): a built wheel then runs where liburing is not installed, as nixl's wheels do, and no other copy of
liburing in the process (nixl brings its own) is the one our bindings call. Without it, the shared
library is linked and must be installed where the wheel runs.
``KVSTREAM_LIBURING=shared`` links the shared library even where the static one exists.
"""
import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup

INSTALL_HINT = (
    "kvstream-hicache needs liburing's headers and pkg-config to build its io_uring layer.\n"
    "  Debian/Ubuntu: sudo apt-get install liburing-dev pkg-config\n"
    "  Fedora/RHEL:   sudo dnf install liburing-devel pkgconf-pkg-config"
)


def _pkg_config(*args):
    if shutil.which("pkg-config") is None:
        sys.exit("error: pkg-config not found.\n" + INSTALL_HINT)
    try:
        out = subprocess.run(["pkg-config", *args, "liburing"], check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError:
        sys.exit("error: liburing not found by pkg-config.\n" + INSTALL_HINT)
    return out.stdout.split()


def _extensions():
    from Cython.Build import cythonize

    cflags = _pkg_config("--cflags")
    libs = _pkg_config("--libs")
    static = _static_liburing(libs)
    ext = Extension(
        "kvstream_hicache._uring",
        sources=["_uring/_uring.pyx"],  # includes bytes.pxi, buffers.pxi, ring.pxi, keys.pxi, files.pxi: one module
        depends=["_uring/crc32c.h", "_uring/liburing.pxd", "_uring/bytes.pxi", "_uring/buffers.pxi",
                 "_uring/ring.pxi", "_uring/keys.pxi", "_uring/files.pxi"],  # rebuild on change; shipped in the sdist
        include_dirs=[f[2:] for f in cflags if f.startswith("-I")] + ["_uring"],
        library_dirs=[f[2:] for f in libs if f.startswith("-L")],
        libraries=[f[2:] for f in libs if f.startswith("-l") and not (static and f == "-luring")],
        extra_objects=[static] if static else [],
        extra_compile_args=["-O3", "-msse4.2"] if _is_x86() else ["-O3"],
    )
    return cythonize([ext], language_level=3, compiler_directives={"boundscheck": False, "wraparound": False})


def _static_liburing(libs):
    """The path of liburing.a in pkg-config's library directory (or -L ones), or None."""
    if os.environ.get("KVSTREAM_LIBURING", "static") == "shared":
        return None
    dirs = [f[2:] for f in libs if f.startswith("-L")] + _pkg_config("--variable=libdir")
    return next((p for p in (os.path.join(d, "liburing.a") for d in dirs) if os.path.exists(p)), None)


def _is_x86():
    import platform

    return platform.machine().lower() in ("x86_64", "amd64", "i686")


setup(ext_modules=_extensions(), package_data={"kvstream_hicache": ["*.pyi", "py.typed"]})
