"""Installs the repository's `libs` and `services` folders as the packages
`gpusched.libs` and `gpusched.services` (pyproject.toml holds everything else)."""

from setuptools import find_packages, setup

ROOTS = ("libs", "services")

setup(
    package_dir={f"gpusched.{root}": root for root in ROOTS},
    packages=[
        f"gpusched.{root}{'.' + sub if sub else ''}"
        for root in ROOTS
        for sub in ["", *find_packages(root)]
    ],
)
