"""Ready-made agents on top of pipecat_taste: the phone-style TASTE agent, a scripted caller, and
simulated calls between them (``taste-agent call --simulate``)."""
