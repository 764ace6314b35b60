"""What the commands that call a server (infer, health, bench) share: TLS and token flags, the argument
types their numbers take, and `Refused`."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import Any


class Refused(Exception):
    """A user mistake a command reports in one line (exit 2), not with a traceback."""


def target(text: str) -> str:
    """An argument type: a server address as the client takes it (host:port, a gRPC target URI, or a
    comma list of addresses), checked as the client checks it."""
    from attnserve._channel import resolve_target

    try:
        resolve_target(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("target: ")) from None
    return text


def output_file(text: str) -> str:
    """An argument type: a file the command writes at its end, checked before it starts, so that a
    benchmark's results are not lost to a directory that is not there (the write itself may still fail:
    a full disk)."""
    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"expected a file to write, got {text!r}, a directory")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"expected a file in a directory that exists, got {text!r} ({folder} is not)")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"expected a file in a directory this user may write, got {text!r}")
    return text


def whole_number(text: str) -> int:
    """An argument type: a whole number >= 1 (argparse reports anything else in one line)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return n


def comma_list(what: str) -> Callable[[str], tuple[int, ...]]:
    """An argument type: `what` (a whole number >= 1), or a comma list of them."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(n) for n in text.split(","))
        except ValueError:
            values = ()
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"expected {what} or a comma list of them, each >= 1, got {text!r}")
        return values

    return parse


lengths = comma_list("a length")


def finite_number(what: str, *, zero: bool = False) -> Callable[[str], float]:
    """An argument type: `what`, a finite number > 0 (>= 0 with `zero`)."""
    bound = ">= 0" if zero else "> 0"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
            raise argparse.ArgumentTypeError(f"expected {what} {bound}, got {text!r}")
        return value

    return parse


seconds = finite_number("a number of seconds")
seconds_or_zero = finite_number("a number of seconds", zero=True)
positive_number = finite_number("a number")


def add_connection_flags(p: argparse.ArgumentParser) -> None:
    """TLS and token flags, the same for every client command."""
    g = p.add_argument_group("TLS and tokens (README: Security)")
    g.add_argument("--tls", action="store_true", help="TLS, trusting the system's roots (implied by the other --tls-*)")
    g.add_argument("--tls-ca", help="PEM file of the CA to trust instead of the system's roots")
    g.add_argument("--tls-cert", help="PEM client certificate, for mTLS (with --tls-key)")
    g.add_argument("--tls-key", help="PEM private key of --tls-cert")
    g.add_argument(
        "--token-file", help="file holding the bearer token (default: $ATTNSERVE_TOKEN; none: no token sent)"
    )


def connection_from(args: argparse.Namespace) -> dict[str, Any]:
    """Client keyword arguments from the connection flags; raises Refused for an unreadable file."""
    token = os.environ.get("ATTNSERVE_TOKEN")
    if args.token_file:
        try:
            with open(args.token_file) as f:
                token = f.read().strip()
        except OSError as exc:
            raise Refused(f"--token-file {args.token_file}: {exc.strerror}") from None
    files = {"ca": args.tls_ca, "cert": args.tls_cert, "key": args.tls_key}
    for name, path in files.items():
        if path and not os.path.isfile(path):
            raise Refused(f"--tls-{name} {path}: no such file")
    return {"tls": args.tls, **files, "token": token}
