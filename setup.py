"""Packaging beyond setup.cfg: the kernel sources live in the top-level ``kernels/`` folder and
ship inside the wheel as ``hcache/kernels/`` (docs/design.md §1), which setup.cfg's ``find:``
cannot express."""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["hcache", "hcache.*"]) + ["hcache.kernels"],
      package_dir={"hcache.kernels": "kernels"})
