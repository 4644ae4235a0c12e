"""The provider's commands to a running local executor, over its control socket:
`base-executor stats` (stats_view.py) and `base-executor adapters add|list|remove`, the shared
hosted adapters every tenant may name. Adapter commands carry the provider's token, which the
executor writes at start into the user's run directory (proto/urls.provider_token_path): only the
executor's own user can read it."""
from __future__ import annotations

import pathlib
import sys

import zmq

from symbiont.proto import executor_pb2 as pb
from symbiont.proto import urls


def request(url: str, req: pb.ControlRequest, timeout_s: float = 30.0, what: str = "request") -> pb.ControlReply:
    """One control request to the local executor serving `url`; RuntimeError when it is refused."""
    scheme, name = urls.parse(url)
    if scheme != "local":
        raise ValueError(f"{url}: the provider's commands go to the executor's host (local://NAME)")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(urls.control_endpoint(name))
        sock.send(req.SerializeToString())
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no executor answered at {url} within {timeout_s:.0f} s")
        reply = pb.ControlReply.FromString(sock.recv_multipart()[-1])
    finally:
        sock.close()
    if reply.status.code != pb.OK:
        raise RuntimeError(f"{what} refused: {pb.Code.Name(reply.status.code)}: {reply.status.message}")
    return reply


def _as_provider(url: str, **kind) -> pb.ControlRequest:
    _, name = urls.parse(url)
    try:
        token = pathlib.Path(urls.provider_token_path(name)).read_text()
    except FileNotFoundError:
        raise RuntimeError(f"no executor serves {url} on this host for this user (no provider token)") from None
    return pb.ControlRequest(tenant_id=0, token=token, **kind)


def add_adapter(url: str, name: str, directory: str) -> pb.AdapterInfo:
    """Hosts the PEFT LoRA adapter in `directory` as the provider's shared adapter `name`."""
    from symbiont.proto.adapters import load_peft_dir, peft_weights

    state, config = load_peft_dir(directory)
    return host_weights(url, name, peft_weights(state, config))


def host_weights(url: str, name: str, weights: list[pb.AdapterWeight]) -> pb.AdapterInfo:
    """Hosts the provider's shared adapter `name` from its per-unit weights (proto.adapters)."""
    req = _as_provider(url, host_adapter=pb.HostAdapterRequest(name=name, weights=weights))
    return request(url, req, what=f"adapter {name!r}").host_adapter


def list_adapters(url: str) -> list[pb.AdapterInfo]:
    return list(request(url, _as_provider(url, adapters=pb.AdaptersRequest()), what="adapters").adapters.adapters)


def remove_adapter(url: str, name: str) -> None:
    request(url, _as_provider(url, remove_adapter=pb.RemoveAdapterRequest(name=name)), what=f"removing adapter {name!r}")


def adapters_main(args) -> int:
    """`base-executor adapters add NAME DIR | list | remove NAME [--url local://NAME]`."""
    try:
        if args.action == "add":
            if len(args.names) != 2:
                raise ValueError("adapters add NAME DIR")
            info = add_adapter(args.url, args.names[0], args.names[1])
            print(f"hosted {info.name!r} (id {info.id}, {len(info.units)} units, ranks {sorted(set(info.ranks))}, "
                  f"{info.bytes / 2**20:.1f} MiB), shared with every tenant")
        elif args.action == "remove":
            if len(args.names) != 1:
                raise ValueError("adapters remove NAME")
            remove_adapter(args.url, args.names[0])
            print(f"removed {args.names[0]!r}")
        else:
            for a in list_adapters(args.url):
                owner = "provider" if a.shared else "a tenant's"
                print(f"{a.name:24s} id {a.id:<5d} {owner:11s} {len(a.units):4d} units  ranks {sorted(set(a.ranks))}  "
                      f"{a.bytes / 2**20:.1f} MiB")
        return 0
    except (ValueError, TimeoutError, RuntimeError, OSError) as e:
        print(f"base-executor adapters: {e}", file=sys.stderr)
        return 2
