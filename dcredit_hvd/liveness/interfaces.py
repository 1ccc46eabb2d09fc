"""Where the liveness channel listens: the one address the collective library uses.

A listener on every interface (``""``) is reachable from every network the host is on, public
ones and container bridges included; the peers need one address only.  ``listen_address``
chooses it, first rule that gives an address of this host:

1. ``DCREDIT_LIVENESS_BIND`` (``liveness.Settings.bind``): an address of this host, or the
   name of an interface (its IPv4 address);
2. every rank of the job on this host: ``127.0.0.1``, which no other host can reach;
3. the interface the collective library was told to use: ``HOROVOD_GLOO_IFACE`` (set by
   ``horovodrun``), ``OMPI_MCA_btl_tcp_if_include`` (``mpirun --mca btl_tcp_if_include``: its
   first interface name, or the first subnet that holds an address of this host),
   ``GLOO_SOCKET_IFNAME`` (``torch.distributed``);
4. an address this host's name resolves to (``HOROVOD_HOSTNAME``, the host name, its FQDN:
   the name the launcher reached it by), then the source address of its default route;
5. ``127.0.0.1``.
"""
from __future__ import annotations

import ipaddress
import os
import socket
import struct
from collections.abc import Mapping
from typing import Optional

#: The variables, in order, that name the interface of the collective library.
LIBRARY_VARIABLES = ("HOROVOD_GLOO_IFACE", "OMPI_MCA_btl_tcp_if_include", "GLOO_SOCKET_IFNAME")
LOOPBACK = "127.0.0.1"
_SIOCGIFADDR = 0x8915


def interface_addresses() -> dict[str, str]:
    """Each interface's IPv4 address (Linux; interfaces without one are left out)."""
    try:
        import fcntl
        names = [name for _, name in socket.if_nameindex()]
    except (ImportError, OSError):
        return {}
    found: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for name in names:
            try:
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR,
                                     struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def bindable(address: str) -> bool:
    """Whether this host can listen on ``address`` (it is one of its own)."""
    try:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
        return True
    except (OSError, OverflowError, UnicodeError):
        return False


def resolve_choice(choice: str, interfaces: Optional[dict[str, str]] = None) -> Optional[str]:
    """``choice`` (an address, or an interface name) as an address of this host, else None."""
    choice = choice.strip()
    try:
        ipaddress.ip_address(choice)
        return choice if bindable(choice) else None
    except ValueError:
        pass
    interfaces = interface_addresses() if interfaces is None else interfaces
    return interfaces.get(choice)


def _library_address(environ: Mapping[str, str], interfaces: dict[str, str]) -> Optional[str]:
    for variable in LIBRARY_VARIABLES:
        for item in filter(None, (part.strip() for part in environ.get(variable, "").split(","))):
            if "/" in item:                     # a subnet: this host's address in it
                try:
                    subnet = ipaddress.ip_network(item, strict=False)
                except ValueError:
                    continue
                for address in interfaces.values():
                    if ipaddress.ip_address(address) in subnet:
                        return address
            elif item in interfaces:
                return interfaces[item]
    return None


def listen_address(choice: str = "", environ: Optional[Mapping[str, str]] = None,
                   single_host: bool = False) -> str:
    """The address to listen on, by the rules of this module's docstring.

    ``choice``: rule 1 (validated beforehand by ``liveness.validate``; one that is no address
    of this host is an error here).  ``single_host``: rule 2, every rank on this host.
    """
    environ = os.environ if environ is None else environ
    interfaces = interface_addresses()
    if choice.strip():
        address = resolve_choice(choice, interfaces)
        if address is None:
            raise ValueError(f"DCREDIT_LIVENESS_BIND={choice!r} is neither an address of this "
                             f"host nor one of its interfaces ({', '.join(interfaces) or 'none'})")
        return address
    if single_host:
        return LOOPBACK
    address = _library_address(environ, interfaces)
    if address is not None:
        return address
    for address in named_addresses(environ):
        if bindable(address):
            return address
    return LOOPBACK


def listener(bind: Optional[str], advertise: Optional[list[str]], choice: str,
             backlog: int) -> socket.socket:
    """A listening socket on ``bind``, else on the first address of ``advertise`` this host
    has, else where ``listen_address(choice)`` says."""
    if bind is None:
        bind = next((a for a in advertise or [] if bindable(a)), None)
    if bind is None:
        bind = listen_address(choice)
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    return socket.create_server((bind, 0), family=family, backlog=backlog)


def named_addresses(environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """The non-loopback addresses peers may reach this host at: what its name resolves to (the
    same name the launcher used to start it), then the source address of the default route
    (which covers hosts whose name resolves to loopback only, Debian's 127.0.1.1)."""
    environ = os.environ if environ is None else environ
    addresses: list[str] = []
    names = [environ.get("HOROVOD_HOSTNAME", ""), socket.gethostname(), socket.getfqdn()]
    for name in filter(None, names):
        try:
            infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
        except OSError:
            continue
        for info in infos:
            address = info[4][0]
            if address not in addresses and not address.startswith("127."):
                addresses.append(address)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))           # a UDP connect sends nothing
            address = probe.getsockname()[0]
        if address not in addresses and not address.startswith("127."):
            addresses.append(address)
    except OSError:
        pass
    return addresses
