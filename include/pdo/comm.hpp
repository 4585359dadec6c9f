// pdo/comm.hpp: the comm layer (communicator concept, threads and MPI backends, mesh groups).
#pragma once

#include <pdo/comm/communicator_concept.hpp>
#include <pdo/comm/group_communicator.hpp>
#include <pdo/comm/mesh_comms.hpp>
#include <pdo/comm/threads/communicator.hpp>

#if defined(PDO_WITH_MPI)
#include <pdo/comm/mpi/communicator.hpp>
#endif
