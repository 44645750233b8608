"""Settings for every pytest run in this repository (tests/ and bench/).

The kernels a test run compiles go to a TileLang cache inside the run, pytest's cache directory
(``.pytest_cache/d/tilelang`` under the repository root, kept between runs), not to the user's own
``~/.tilelang/cache``; a TILELANG_CACHE_DIR the caller set is used as given.
"""
import os


def pytest_configure(config):
    if os.environ.get("TILELANG_CACHE_DIR"):
        return
    cache = getattr(config, "cache", None)  # None with -p no:cacheprovider
    path = cache.mkdir("tilelang") if cache is not None else config.rootpath / ".pytest_cache" / "d" / "tilelang"
    os.makedirs(path, exist_ok=True)
    os.environ["TILELANG_CACHE_DIR"] = str(path)  # before any test imports tilelang
