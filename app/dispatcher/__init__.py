"""The dispatcher process (`inferq dispatch`): the order in which waiting jobs enter their
queues (docs/architecture.md, "Fair share")."""
