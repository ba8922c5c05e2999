"""Print the versions CI tests with (README, "Tested with"): the libraries whose internals the
suite reaches, so a failure on a new release names the release."""

from importlib.metadata import PackageNotFoundError, version

NAMES = ("torch", "torchvision", "ray", "mlflow", "optuna", "timm", "numpy", "scipy", "pydantic", "pyarrow")


def main() -> None:
    found = []
    for name in NAMES:
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            found.append(f"{name} (not installed)")
    print("tested with: " + ", ".join(found), flush=True)


if __name__ == "__main__":
    main()
