"""Event and snapshot stores: the SPI, the backends, the conformance kit."""
