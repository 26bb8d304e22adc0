"""The HTTP replica router (`conveyor router`): one endpoint in front of several conveyor daemons,
each a replica with its own engines, that sends each request where its prompt's prefix is likely
cached, unless that replica is much busier than the others. It proxies HTTP and nothing else:
replicas keep their own tokenizers, schedulers and KV caches, and the choice itself is the data-
parallel router's policy (conveyor.stages.router.policy) over characters instead of tokens.

config.py   RouterConfig, the flags of `conveyor router`
prompt.py   the routing key: a request body's prompt text, hashed in fixed-size character chunks
replicas.py which replicas are ready, their requests in flight, the policy that picks one
discovery.py the replicas a DNS name resolves to (a Kubernetes headless Service), for scaling
health.py   the /health poller that marks replicas ready and not
proxy.py    the aiohttp app: routed POSTs, everything else passed to a ready replica, /health,
            /metrics, the JSON errors
main.py     `conveyor router`: build the app, serve until SIGTERM
"""
