// One process at a time in a run folder: a second lock on it is refused naming the holder, and
// the folder is free again once the first lock is gone.
#include "base/folder_lock.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <optional>
#include <string>

#include "base/error.h"

namespace pollen {
namespace {

TEST(FolderLock, ASecondHolderIsRefusedNamingTheFirstUntilItLetsGo) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("pollen_folder_lock_" + std::to_string(::getpid())) / "run";
  std::optional<FolderLock> first;
  first.emplace(dir, "run.dir");  // creates the folder
  EXPECT_TRUE(std::filesystem::is_directory(dir));
  try {
    FolderLock second(dir, "run.dir");
    ADD_FAILURE() << "two holders of one folder";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("run.dir '" + dir.string() + "' is in use by another process"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find(" " + std::to_string(::getpid()) + ")"), std::string::npos) << what;
  }
  first.reset();
  EXPECT_NO_THROW(FolderLock again(dir, "run.dir"));
  std::filesystem::remove_all(dir.parent_path());
}

}  // namespace
}  // namespace pollen
