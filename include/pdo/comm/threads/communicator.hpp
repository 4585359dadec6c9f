// pdo/comm/threads/communicator.hpp: the threads backend: places of one process, shared memory.
#pragma once

#include <pdo/comm/group_communicator.hpp>
#include <pdo/comm/threads/local_group.hpp>

namespace pdo::threads {

/// @brief A member of a group whose places all live in this process. Collectives read
/// the other members' buffers directly: all_reduce moves each byte once per member
/// (the memory-traffic limit), with no staging copies and no locks on the data path.
using communicator = group_communicator<detail::local_group>;

static_assert(pdo::communicator<communicator>);

}  // namespace pdo::threads
