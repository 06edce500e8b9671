"""lmzoo dpo: preference optimization (DPO, IPO, hinge, robust DPO, SimPO; RPO) on the shared training loop."""
