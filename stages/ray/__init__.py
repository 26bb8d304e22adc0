"""Engine ranks on the nodes of a Ray cluster (`conveyor serve --ray-address`): placement groups
(placement.py), one actor per remote stage process that runs it as a subprocess on its node
(host.py), and the process handles the launcher supervises (processes.py)."""
